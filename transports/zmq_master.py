"""ZeroMQ, the master's side: a ROUTER socket that every worker's DEALER
(:mod:`transports.zmq_worker`) connects to, over ``tcp://`` or ``ipc://``. Messages
are :mod:`transports.wire` frames: arrays travel zero-copy, never pickled.

A zmq socket belongs to one thread, yet the master must keep talking to its workers
while it computes. So one *I/O thread* (:mod:`transports.master_io`) owns the socket:
it admits workers, sends what :meth:`~ZmqTransport.send` queued (waking it with a
:class:`~transports.wakeup.Wakeup`) and heartbeats, queues what arrives for
:meth:`~ZmqTransport.recv`, and declares a worker lost when nothing came from it for
``peer_timeout_s``. Workers may come and go: after :meth:`~ZmqTransport.start`, each new
one is admitted under a new index and reported by :meth:`~ZmqTransport.joined`.

With ``curve`` (:class:`transports.curve.CurveServer`) only workers whose public key is
authorised get past ZeroMQ's handshake, and all traffic is encrypted. Without it the
master binds only addresses of this machine, unless ``insecure=True``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import zmq

from transports import wire
from transports.base import Message, Transport, WorkerInfo, WorkerLost
from transports.curve import CurveServer
from transports.endpoints import check_exposure, connect_hint
from transports.master_io import SHUTDOWN_LINGER_S, Book, MasterIO
from transports.wakeup import Wakeup

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = SHUTDOWN_LINGER_S + 4.0

__all__ = ["ZmqTransport", "connect_hint"]


def _bind(ctx: zmq.Context, bind: str, max_bytes: int, curve: CurveServer | None) -> tuple[zmq.Socket, Any]:
    """The master's ROUTER, bound, with its authenticator (None without CURVE)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker raises, not vanishes
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker that reconnects keeps its identity
    sock.setsockopt(zmq.MAXMSGSIZE, max(max_bytes, wire.MAX_HEADER_BYTES))  # per frame; master_io caps the total
    auth = None
    try:
        if curve is not None:
            auth = curve.apply(ctx, sock)
        sock.bind(bind)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        raise OSError(
            f"cannot bind {bind!r}: {e}; use e.g. tcp://*:5555, tcp://127.0.0.1:0 (a free port) "
            "or ipc:///tmp/workers.sock, and make sure no other process holds the address"
        ) from e
    return sock, auth


class ZmqTransport(Transport):
    """Master side: a ROUTER bound at ``bind``, one DEALER per worker.

    ``bind`` is ``tcp://*:5555`` (all interfaces), ``tcp://127.0.0.1:0`` (a free port;
    read :attr:`bound_address`), or ``ipc:///path``. ``protocol`` is the version of the
    task protocol the master speaks: a worker whose hello says another is refused, and
    told why. ``curve`` authenticates and encrypts (:class:`~transports.curve.CurveServer`);
    binding beyond this machine without it raises ValueError unless ``insecure``.
    ``max_message_bytes`` caps the array data of one message (its frames in all, and what
    its header declares). Arrays handed to :meth:`send` are sent without copying, so leave
    them unmodified until the worker's reply arrives.
    """

    name = "zmq"

    def __init__(
        self,
        bind: str = "tcp://*:5555",
        *,
        protocol: int,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
        curve: CurveServer | None = None,
        insecure: bool = False,
        **_: Any,
    ) -> None:
        if not wire.Int.accepts(protocol):
            raise TypeError(f"protocol must be an int, the version of the task protocol; got {protocol!r}")
        if not heartbeat_s > 0 or not peer_timeout_s > heartbeat_s:
            raise ValueError(f"need 0 < heartbeat_s < peer_timeout_s, got {heartbeat_s} and {peer_timeout_s}")
        if curve is not None and not isinstance(curve, CurveServer):
            raise TypeError(f"curve must be a transports.curve.CurveServer, got {type(curve).__name__}")
        check_exposure(bind, secured=curve is not None, insecure=insecure)
        self.secured = curve is not None
        self._ctx = zmq.Context()
        try:
            self._sock, self._auth = _bind(self._ctx, bind, int(max_message_bytes), curve)
        except BaseException:
            self._ctx.term()
            raise
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._book = Book()
        self._wakeup = Wakeup()
        self._io = MasterIO(
            self._sock,
            self._book,
            self._wakeup,
            protocol=protocol,
            heartbeat_s=float(heartbeat_s),
            peer_timeout_s=float(peer_timeout_s),
            max_bytes=int(max_message_bytes),
        )
        self._closed = False
        self._started = False
        self._thread = threading.Thread(target=self._io.run, name="zmq-master-io", daemon=True)
        self._thread.start()

    @property
    def bound_address(self) -> str:
        """The endpoint actually bound, e.g. ``tcp://127.0.0.1:41234`` after binding port 0."""
        return self._endpoint

    # ---- the caller's API ------------------------------------------------------------
    def start(self, n_workers: int, timeout: float = 60.0) -> list[WorkerInfo]:
        """Wait until ``n_workers`` workers are admitted and alive; return them, by index.

        Hellos that came before are admitted first. A worker lost meanwhile is not
        returned (so the indices need not be 0..n-1); workers admitted beyond the first
        ``n_workers`` are reported by :meth:`joined`.
        """
        if not isinstance(n_workers, int) or n_workers < 1:
            raise ValueError(f"n_workers must be a positive int, got {n_workers!r}")
        book = self._book
        with book.cond:
            if self._started or self._closed:
                raise RuntimeError("start() can be called once, on a transport that is not closed")
            self._started = book.admitting = True
        self._wakeup.wake()
        deadline = time.monotonic() + timeout
        with book.cond:
            while True:
                if self._closed:
                    raise RuntimeError("the transport was closed while start() waited for workers")
                if book.failure is not None:
                    raise RuntimeError(f"the zmq transport's I/O thread failed: {book.failure!r}") from book.failure
                live = [w for w in book.fresh if w.index not in book.lost]
                remaining = deadline - time.monotonic()
                if len(live) >= n_workers:
                    break
                if remaining <= 0:
                    raise TimeoutError(
                        f"only {len(live)} of {n_workers} workers said hello within {timeout:g} s; "
                        f"start workers that connect to {connect_hint(self._endpoint)}"
                    )
                book.cond.wait(remaining)
            chosen, book.fresh = live[:n_workers], live[n_workers:]
            book.known.update(w.index for w in chosen)
        return chosen

    def joined(self) -> list[WorkerInfo]:
        """Workers admitted since start() or the previous call, and still alive; never blocks."""
        with self._book.cond:
            fresh = [w for w in self._book.fresh if w.index not in self._book.lost]
            self._book.fresh = []
            self._book.known.update(w.index for w in fresh)
        return fresh

    def send(self, worker: int, msg: Message) -> None:
        with self._book.cond:
            self._check_open("send")
            if not isinstance(worker, int) or worker not in self._book.known:
                raise ValueError(f"no worker {worker!r}; the workers are those start() and joined() returned")
            if worker in self._book.lost:
                raise WorkerLost(worker, self._book.lost[worker])
        self._io.outbox.put((worker, wire.encode(msg)))  # encode validates: a bad message fails here, in the caller
        self._wakeup.wake()

    def recv(self, timeout: float) -> tuple[int, Message]:
        """The next message from a worker that start() or joined() returned; raises TimeoutError,
        WorkerLost, or ProtocolError for a message the worker sent that the master could not read."""
        with self._book.cond:
            self._check_open("recv")
        deadline = time.monotonic() + timeout
        while True:
            try:
                event, k, payload = self._io.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no message from any worker within {timeout:g} s") from None
            if event == "failed":
                raise RuntimeError(f"the zmq transport's I/O thread failed: {payload!r}") from payload
            with self._book.cond:
                known = k in self._book.known
            if not known:  # a worker the caller never heard of (lost, or unsolicited, before joined())
                log.debug("dropping %s from worker %s, not yet reported by joined()", event, k)
                continue
            if event == "message":
                return k, payload
            if event == "lost":
                raise WorkerLost(k, payload)
            raise wire.ProtocolError(f"worker {k} sent a malformed message: {payload}")

    def _check_open(self, what: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"{what}() needs a started, open transport")
        failure = self._book.failure
        if failure is not None:
            raise RuntimeError(f"the zmq transport's I/O thread failed: {failure!r}") from failure

    def dropped(self) -> dict[str, int]:
        """How many messages the master dropped since it was made, by kind (see transports.droplog.KINDS):
        from peers that were not workers, or from workers declared lost."""
        return self._io.drops.counts()

    def traffic(self) -> dict[int, tuple[int, int]]:
        """Bytes (sent to, received from) each worker, all frames including heartbeats."""
        with self._book.cond:
            return {k: (s, r) for k, (s, r) in enumerate(self._book.traffic)}

    def close(self) -> None:
        """Send ``shutdown`` to every worker, stop the I/O thread, release the sockets. Idempotent."""
        with self._book.cond:
            if self._closed:
                return
            self._closed = True
            self._book.cond.notify_all()  # a start() still waiting gives up
        self._io.stop.set()
        self._wakeup.wake()
        self._thread.join(timeout=_JOIN_TIMEOUT_S)
        if self._thread.is_alive():  # never seen; term() would wait on its socket, so leave it
            log.error("zmq I/O thread did not stop within %.0f s", _JOIN_TIMEOUT_S)
        else:
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
        self._wakeup.close()

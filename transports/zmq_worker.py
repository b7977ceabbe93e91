"""ZeroMQ, the worker's side: a DEALER that connects to the master's ROUTER and serves a handler.

:func:`serve` looks for a master on a fresh socket each time, so nothing of an earlier master carries
over, serves it (:func:`~transports.session.welcome.serve_master` over :class:`ZmqWorkerLink`) and,
when it is lost, looks again. With ``curve`` (:class:`transports.curve.CurveClient`) the socket
authenticates with the worker's key and encrypts everything.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from transports import wire
from transports.base import Handler
from transports.curve import CurveClient
from transports.pieces import Reassembly, is_piece, pieces
from transports.session.link import WorkerLink
from transports.session.settings import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, MASTER_LOST, Settings, to_stderr
from transports.session.welcome import BACKOFF_MAX_S, serve_master
from transports.session.worker import Compute
from transports.wakeup import Wakeup

_DRAIN_BATCH = 256  # messages read per wake-up before heartbeats get their turn again
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_HANDSHAKE_ATTEMPTS = 3  # failed handshakes in a row without a reason that settles it, before giving up
_KEYS_HINT = "its secret key and the master's public key (see the `keygen` command)"
_WATCHED = _HANDSHAKE_FAILURES | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


@dataclass(kw_only=True)
class _Setup(Settings):
    connect: str
    curve: CurveClient | None


def serve(
    connect: str,
    handler: Handler,
    heartbeat_s: float = 0.4,
    peer_timeout_s: float = 30.0,
    welcome_timeout_s: float | None = 60.0,
    max_message_bytes: int = wire.DEFAULT_MAX_BYTES,
    stop: threading.Event | None = None,
    log_line: Callable[[str], None] = to_stderr,
    quiet: bool = False,
    *,
    curve: CurveClient | None = None,
    retry_for: float | None = 600.0,
    forever: bool = False,
) -> int:
    """Serve ``handler`` to the master at ``connect``, and to the masters after it; return an exit code
    (docs/writing-a-transport.md, "The worker side", says when each comes). ``welcome_timeout_s`` and
    ``retry_for`` may be None: no limit. Problems go to ``log_line``, one line each; ``quiet`` drops the rest.
    """
    if curve is not None and not isinstance(curve, CurveClient):
        raise TypeError(f"curve must be a transports.curve.CurveClient, got {type(curve).__name__}")
    welcome_timeout_s = math.inf if welcome_timeout_s is None else float(welcome_timeout_s)
    retry_for = math.inf if retry_for is None else float(retry_for)
    setup = _Setup(
        connect=connect,
        heartbeat_s=heartbeat_s,
        peer_timeout_s=peer_timeout_s,
        max_bytes=int(max_message_bytes),
        stop=stop,
        say=log_line,
        info=(lambda line: None) if quiet else log_line,
        curve=curve,
    )
    ctx = zmq.Context()
    compute = Compute(handler)
    try:
        return _serve_masters(ctx, compute, setup, welcome_timeout_s, retry_for, forever)
    except KeyboardInterrupt:
        log_line("interrupted; worker stopping")
        return EXIT_INTERRUPTED
    finally:
        compute.stop()
        ctx.term()  # only this thread ever touched zmq, and it closed its sockets: this cannot wait


def _deadline(seconds: float) -> float | None:
    return None if math.isinf(seconds) else time.monotonic() + max(0.0, seconds)


def _serve_masters(
    ctx: zmq.Context, compute: Compute, setup: _Setup, welcome_timeout_s: float, retry_for: float, forever: bool
) -> int:
    """One master after another: look, serve, and decide what comes next."""
    deadline = _deadline(welcome_timeout_s)
    giving_up = (
        f"no welcome from a master at {setup.connect} within {welcome_timeout_s:g} s; is the master running, "
        "waiting for workers, and reachable from this machine?"
    )
    master = f"the master at {setup.connect}"
    session = 0  # one per master: a result computed for an earlier one is dropped
    while True:
        session += 1
        link = _connect(ctx, compute.wakeup, setup)
        if link is None:
            return EXIT_FAILED
        try:
            code = serve_master(
                link, compute, setup, master=master, deadline=deadline, giving_up=giving_up, session=session
            )
        finally:
            link.close()
        compute.forget()
        if code == EXIT_OK and forever:
            setup.info(f"waiting for the next master at {setup.connect}")
            deadline = None
        elif code == MASTER_LOST and retry_for > 0:
            setup.say(f"saying hello again to {setup.connect} for up to {retry_for:g} s")
            deadline = _deadline(retry_for)
            giving_up = (
                f"master went away: no master at {setup.connect} for {retry_for:g} s since the last one was lost; "
                "worker exiting"
            )
        elif code == MASTER_LOST:
            setup.say("master went away; worker exiting")
            return EXIT_FAILED
        else:
            return code


def _connect(ctx: zmq.Context, wakeup: Wakeup, setup: _Setup) -> ZmqWorkerLink | None:
    """A fresh DEALER (a new identity: nothing of an earlier master carries over), connecting; None if it
    cannot be made (said why)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(setup.max_bytes, wire.MAX_HEADER_BYTES))
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(BACKOFF_MAX_S * 1000))  # zmq's reconnects back off too
    if setup.curve is not None:
        try:
            setup.curve.apply(sock)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            setup.say(f"cannot use the CURVE keys {setup.curve!r}: {e}")
            return None
    link = ZmqWorkerLink(sock, wakeup, setup)
    try:
        sock.connect(setup.connect)
    except zmq.ZMQError as e:
        link.close()
        setup.say(f"cannot connect to {setup.connect!r}: {e}; expected tcp://HOST:PORT or ipc:///path")
        return None
    return link


class ZmqWorkerLink(WorkerLink):
    """The DEALER, polled beside the compute thread's wake-up and, until the welcome, its monitor: it
    sends only once a handshake succeeded, so that nothing piles up in zmq's queue for a master that is
    not there yet, and a refused key or a mismatch of keys makes it ``gone``."""

    def __init__(self, sock: zmq.Socket, wakeup: Wakeup, setup: _Setup) -> None:
        self.sock, self.wakeup, self.setup = sock, wakeup, setup
        self.assembly = Reassembly(setup.max_bytes)  # the master's message in pieces (``pieces.py``), if any
        self.monitor: zmq.Socket | None = sock.get_monitor_socket(_WATCHED)
        self.connected, self.failed_handshakes = False, 0
        self.poller = zmq.Poller()
        for polled in (sock, wakeup.fileno(), self.monitor):
            self.poller.register(polled, zmq.POLLIN)

    def welcomed(self) -> None:
        """Stop watching: from now on zmq queues what is sent while it reconnects."""
        self._unwatch()
        self.connected = True

    def close(self) -> None:
        self._unwatch()
        self.sock.close(linger=0)

    def _unwatch(self) -> None:
        if self.monitor is not None:
            self.poller.unregister(self.monitor)
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None

    def wait(self, timeout: float) -> None:
        ready = dict(self.poller.poll(max(1, int(timeout * 1000))))
        if self.wakeup.fileno() in ready:
            self.wakeup.drain()
        if self.monitor is not None and self.monitor in ready:
            self._on_event(recv_monitor_message(self.monitor))

    def receive(self) -> list[list | None]:
        out: list[list | None] = []
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if not is_piece(frames):
                out.append(frames)
                continue
            try:
                out.append(self.assembly.add(frames))  # None until its last piece: a sign of life
            except wire.ProtocolError as e:
                self.gone = f"the master's message in pieces broke: {e}"
                break
        return out

    def send(self, frames: list, *, control: bool = False) -> bool:
        if not self.connected:
            return False
        try:
            for message in pieces(frames) or [frames]:
                self.sock.send_multipart(message, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # a message cut short: the master drops it when the next one begins
            return False
        return True

    def _on_event(self, event: dict) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected, self.failed_handshakes, self.renewed = True, 0, True
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self.connected = False
        else:
            self.failed_handshakes += 1
            why = self._handshake_failed(event)
            self.gone = f"cannot join: {why}" if why else ""

    def _handshake_failed(self, event: dict) -> str:
        """Why a refused key or a mismatch of keys ends the search; other failures (which may be the
        network's) only after _HANDSHAKE_ATTEMPTS in a row ("" before)."""
        connect, curve, n = self.setup.connect, self.setup.curve, self.failed_handshakes
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            key = curve.public_key.decode() if curve else "?"
            return f"the master at {connect} refused this worker's key ({key}): not among the master's authorised keys"
        if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH and curve is not None:
            return f"the master at {connect} does not use CURVE keys, but this worker does; use keys on both or neither"
        if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return f"the master at {connect} requires CURVE keys: start this worker with {_KEYS_HINT}"
        if n < _HANDSHAKE_ATTEMPTS:
            return ""
        perhaps = (
            f"{curve.server_public_key_file} is not the master's public key, or it does not use CURVE keys"
            if curve
            else f"the master requires CURVE keys (start this worker with {_KEYS_HINT})"
        )
        return f"the handshake with the master at {connect} failed {n} times: perhaps {perhaps}"

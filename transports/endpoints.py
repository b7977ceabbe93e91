"""ZeroMQ addresses: which ones stay on this machine, what a worker should connect to, who sent a frame."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlsplit

import zmq

_WILDCARDS = ("0.0.0.0", "*", "::", None)


def is_local(endpoint: str) -> bool:
    """True for an address only this machine can reach: ``ipc://``, ``inproc://``, or ``tcp://`` on loopback."""
    try:
        parts = urlsplit(endpoint)
        host = parts.hostname
    except ValueError:  # e.g. an unbalanced [ in an IPv6 address: not an address we can call local
        return False
    return parts.scheme in ("ipc", "inproc") or (parts.scheme == "tcp" and host in ("127.0.0.1", "::1", "localhost"))


def check_exposure(bind: str, secured: bool, insecure: bool) -> None:
    """Raise ValueError when ``bind`` is public, not ``secured`` by CURVE, and ``insecure`` was not asked for."""
    if secured or insecure or is_local(bind):
        return
    raise ValueError(
        f"binding {bind} without CURVE keys would let any process that reaches this machine become a "
        "worker: it would take a worker slot, receive the training batches and weights, and could return "
        "poisoned results. Create keys with the `keygen` command (transports.curve.generate_keys) and pass "
        "them (curve=CurveServer(...)), bind a loopback address (tcp://127.0.0.1:5555), or pass insecure=True "
        "(--insecure) to accept the risk"
    )


def connect_hint(endpoint: str) -> str:
    """The address a worker on another machine should connect to, given what the master bound: a wildcard
    bind becomes this machine's address on its default route (its host name may resolve to 127.0.0.1
    elsewhere), or without a route its host name."""
    parts = urlsplit(endpoint)
    if parts.scheme == "tcp" and parts.hostname in _WILDCARDS:
        return f"tcp://{_routed_address() or socket.gethostname()}:{parts.port}"
    return endpoint


def _routed_address() -> str | None:
    """This machine's IPv4 address on its default route, or None (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1 (RFC 5737): never answered, only routed
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def frame_property(frame: Any, name: str) -> str:
    """A property of a received zmq Frame, "" where there is none: ``Peer-Address``, the sender's IP address
    (none over ipc); ``User-Id``, the public key (z85) it authenticated with under CURVE."""
    try:
        return frame.get(name) or ""
    except (zmq.ZMQError, ValueError, TypeError, AttributeError):  # no frame, or no such property
        return ""

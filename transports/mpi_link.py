"""How a :class:`~transports.base.Message` crosses MPI: the wire's frames as raw byte buffers.

One Message is ``1 + n`` MPI messages on ``COMM_WORLD``: a prefix on TAG_PREFIX (int64[PREFIX_LEN]: MAGIC,
the frame count n, each frame's length, zeros after), then the n frames on TAG_FRAME; n = 0 is *bye*. A
peer whose framing breaks is *broken* (what follows could not be resynchronised); :meth:`MpiChannel.finish`
is the closing handshake. Why buffers, polling and the handshake: docs/writing-a-transport.md, "A second
worked example: MPI". mpi4py is imported lazily (:func:`require_mpi`), so this module loads without it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from transports import wire
from transports.session.link import Arrival

# COMM_WORLD tags this transport uses; a program sharing COMM_WORLD must leave them alone.
TAG_PREFIX = 0x7C01
TAG_FRAME = 0x7C02
MAGIC = 0x74696E79636F6E76  # "tinyconv" in ASCII: a prefix that does not start with it is not ours
PREFIX_LEN = 2 + 1 + wire.MAX_ARRAYS  # MAGIC, n, and at most a header and MAX_ARRAYS array lengths
PREFIX_BYTES = PREFIX_LEN * 8

# Between two poll rounds: MPI cannot wake a thread, so a message waits up to this long to be noticed.
# One Test moves megabytes (20 MB polled every 1 ms arrives in ~4 ms): a shorter pause would only cost CPU.
POLL_S = 0.001
_DRAIN_BATCH = 256  # messages read from one peer per round, at most

MPI_HINT = (
    "the mpi transport needs mpi4py and an MPI library: pip install -e '.[mpi]' (or make setup), "
    "then launch with the mpiexec beside that python, e.g. .venv/bin/mpiexec -n 3 .venv/bin/python "
    "examples/cifar10_dist.py --transport mpi"
)


class MpiUnavailable(RuntimeError):
    """mpi4py or the MPI library it needs cannot be loaded; the text says what to install."""


def require_mpi() -> Any:
    """The ``mpi4py.MPI`` module (importing it initialises MPI), or MpiUnavailable naming what to install."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise MpiUnavailable(f"{MPI_HINT} ({e})") from None
    except (RuntimeError, OSError) as e:  # mpi4py is there, but no MPI library it can load
        raise MpiUnavailable(f"{MPI_HINT}; mpi4py found no MPI library: {e}") from None
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:  # one I/O thread, not always the main one, makes every MPI call
        raise MpiUnavailable(
            f"the MPI library gives thread level {level}; the mpi transport needs MPI_THREAD_SERIALIZED "
            "or better (mpi4py asks for MPI_THREAD_MULTIPLE unless mpi4py.rc.thread_level says otherwise)"
        )
    return MPI


class LinkBroken(wire.ProtocolError):
    """A peer's framing is broken: nothing more can be read from it."""


def make_prefix(frames: list) -> np.ndarray:
    """The fixed-size prefix announcing ``frames``: int64[PREFIX_LEN] = MAGIC, n, len_0..len_{n-1}, 0...
    No frames at all is a bye."""
    if len(frames) > PREFIX_LEN - 2:
        raise wire.ProtocolError(f"a message is a header and at most {wire.MAX_ARRAYS} arrays: {len(frames)} frames")
    prefix = np.zeros(PREFIX_LEN, dtype="<i8")
    prefix[0], prefix[1] = MAGIC, len(frames)
    prefix[2 : 2 + len(frames)] = [wire.frames_nbytes([f]) for f in frames]
    return prefix


def check_prefix(prefix: np.ndarray, max_bytes: int) -> list[int]:
    """The frame lengths a received prefix announces ([] for a bye), all checked before any frame buffer is
    allocated; LinkBroken otherwise."""
    if int(prefix[0]) != MAGIC:
        raise LinkBroken(f"a prefix without this transport's MAGIC ({int(prefix[0]):#x}): not a tinyconv peer")
    n = int(prefix[1])
    if not 0 <= n <= PREFIX_LEN - 2:
        raise LinkBroken(f"a prefix announcing {n} frames; a message is a header and at most {wire.MAX_ARRAYS} arrays")
    lengths = [int(v) for v in prefix[2 : 2 + n]]
    if any(int(v) != 0 for v in prefix[2 + n :]):
        raise LinkBroken("a prefix with lengths after its last frame")
    if n == 0:
        return []
    if not 1 <= lengths[0] <= wire.MAX_HEADER_BYTES:
        raise LinkBroken(f"a header frame of {lengths[0]} bytes; it must be 1..{wire.MAX_HEADER_BYTES}")
    if any(v < 0 for v in lengths):
        raise LinkBroken(f"negative frame lengths {lengths}")
    total = sum(lengths[1:])
    if total > max_bytes:
        raise LinkBroken(
            f"array frames adding up to {total} bytes, over the limit of {max_bytes} bytes "
            "(raise max_message_bytes if this is intended)"
        )
    return lengths


@dataclass
class _Incoming:
    """One message being received: its frame buffers, their receive requests, and their statuses."""

    frames: list[np.ndarray]
    requests: list[Any]
    statuses: list[Any]


class MpiChannel:
    """Non-blocking messages between this rank and ``peers`` (ranks of ``comm``); one thread owns it.

    ``broken`` maps each peer whose framing broke to why; ``said_bye`` holds the peers that said bye
    (nothing more comes from them), ``bye_sent`` those this side said it to (nothing more may go to them).
    """

    def __init__(self, comm: Any, peers: list[int], max_bytes: int = wire.DEFAULT_MAX_BYTES) -> None:
        self.MPI = require_mpi()
        self.comm, self.peers, self.max_bytes = comm, list(peers), int(max_bytes)
        self.broken: dict[int, str] = {}
        self.said_bye: set[int] = set()
        self.bye_sent: set[int] = set()
        self._incoming: dict[int, _Incoming] = {}  # at most one message per peer at a time
        self._outgoing: deque[tuple[list[Any], list[Any]]] = deque()  # (requests, the buffers they read)

    def send(self, dest: int, frames: list) -> None:
        """Post ``frames`` (from :func:`transports.wire.encode`; none at all: a bye) to rank ``dest``, never
        blocking: the buffers (the arrays' own memory: leave them unmodified until the reply comes) are kept
        until MPI is done. Nothing goes to a rank this one said bye to."""
        if dest in self.bye_sent:
            return
        MPI = self.MPI
        prefix = make_prefix(frames)
        requests = [self.comm.Isend([prefix, MPI.BYTE], dest, TAG_PREFIX)]
        requests += [self.comm.Isend([f, MPI.BYTE], dest, TAG_FRAME) for f in frames]
        self._outgoing.append((requests, [prefix, *frames]))
        if not frames:
            self.bye_sent.add(dest)

    def poll(self) -> list[Arrival]:
        """One round: let go of finished sends; from each peer, every message that has arrived whole (small
        ones come with their prefix; a large one finishes in a later round), or only a sign of life (frames
        None: the prefix of a large message, the rest on its way)."""
        Testall = self.MPI.Request.Testall
        self._outgoing = deque(o for o in self._outgoing if not Testall(o[0]))
        out: list[Arrival] = []
        for peer in self.peers:
            for _ in range(_DRAIN_BATCH):  # bounded: one chatty peer cannot starve the others
                if peer in self.said_bye:
                    break
                if peer in self.broken:
                    if not self._drop_one(peer):
                        break
                    continue
                try:
                    got = self._receive_one(peer)
                except LinkBroken as e:
                    self.broken[peer] = str(e)
                    continue
                if got is None:
                    break
                out.append(got)
        return out

    def _receive_one(self, peer: int) -> Arrival | None:
        """The next message from ``peer`` if it has arrived whole (starting to receive it if it was only
        announced: then, if it is not whole yet, only a sign of life); None if there is none yet. A bye
        adds ``peer`` to ``said_bye``."""
        incoming = self._incoming.get(peer)
        began = incoming is None
        if began:
            incoming = self._start_receiving(peer)
            if incoming is None:
                return None
        try:
            if not self.MPI.Request.Testall(incoming.requests, incoming.statuses):
                return Arrival(peer, address=f"MPI rank {peer}") if began else None
        except self.MPI.Exception as e:  # e.g. a frame longer than announced: MPI_ERR_TRUNCATE
            del self._incoming[peer]
            raise LinkBroken(f"a frame could not be received as announced: {e}") from None
        del self._incoming[peer]
        counts = [s.Get_count(self.MPI.BYTE) for s in incoming.statuses]
        announced = [f.nbytes for f in incoming.frames]
        if counts != announced:  # a shorter frame would leave uninitialised bytes in its buffer
            raise LinkBroken(f"frames of {counts} bytes where the prefix announced {announced}")
        return Arrival(peer, incoming.frames, f"MPI rank {peer}")

    def _start_receiving(self, peer: int) -> _Incoming | None:
        """The message whose prefix has arrived from ``peer``, its frames' receives posted; None if none has."""
        MPI = self.MPI
        status = MPI.Status()
        if not self.comm.Iprobe(source=peer, tag=TAG_PREFIX, status=status):
            return None
        size = status.Get_count(MPI.BYTE)
        if size != PREFIX_BYTES:  # it cannot be received into a prefix: from now on, drop what this peer sends
            raise LinkBroken(f"a prefix of {size} bytes, not {PREFIX_BYTES}: not this transport's framing")
        prefix = np.empty(PREFIX_LEN, dtype="<i8")
        self.comm.Recv([prefix, MPI.BYTE], source=peer, tag=TAG_PREFIX)  # probed, so already here: no wait
        lengths = check_prefix(prefix, self.max_bytes)
        if not lengths:
            self.said_bye.add(peer)
            return None
        frames = [np.empty(n, dtype=np.uint8) for n in lengths]  # sizes checked just above
        requests = [self.comm.Irecv([f, MPI.BYTE], source=peer, tag=TAG_FRAME) for f in frames]
        self._incoming[peer] = _Incoming(frames, requests, [MPI.Status() for _ in frames])
        return self._incoming[peer]

    def _drop_one(self, peer: int) -> bool:
        """Receive and drop one message that ``peer``, whose framing broke, has sent; False if none has.
        A bye is still understood."""
        MPI = self.MPI
        status = MPI.Status()
        for tag in (TAG_PREFIX, TAG_FRAME):
            if self.comm.Iprobe(source=peer, tag=tag, status=status):
                break
        else:
            return False
        size = status.Get_count(MPI.BYTE)
        if size > max(self.max_bytes, wire.MAX_HEADER_BYTES):
            return False  # too big to take in: it stays unreceived
        scratch = np.empty(size, dtype=np.uint8)
        self.comm.Recv([scratch, MPI.BYTE], source=peer, tag=status.Get_tag())  # probed: already here
        if status.Get_tag() == TAG_PREFIX and size == PREFIX_BYTES:
            prefix = scratch.view("<i8")
            if int(prefix[0]) == MAGIC and not prefix[1:].any():
                self.said_bye.add(peer)
        return True

    def finish(self, peers: list[int], linger_s: float) -> list[int]:
        """Say bye to ``peers``, then receive (and drop) what they send until each said bye, for at most
        ``linger_s`` seconds; returns the peers that did not say bye in time. Afterwards nothing is in
        flight between this rank and the others, so MPI can finalise."""
        for peer in peers:
            self.send(peer, [])  # a bye
        deadline = time.monotonic() + linger_s
        pace = threading.Event()  # never set: its wait paces the polling, MPI cannot wake this thread
        while True:
            self.poll()
            missing = [p for p in peers if p not in self.said_bye]
            if (not missing and not self._outgoing) or time.monotonic() >= deadline:
                break
            pace.wait(POLL_S)
        for incoming in self._incoming.values():  # peers that never said bye: take back their receives
            for r in incoming.requests:
                r.Cancel()
        self._incoming.clear()
        return missing

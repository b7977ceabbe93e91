"""A large message in pieces, so that a peer whose bytes are still flowing is heard as alive: why, and what
a piece is, in docs/writing-a-transport.md, "Crossing a process boundary". Everything about a piece is
checked before a byte of it is kept, and a message put together again is capped like any other.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from transports.wire import MAX_ARRAYS, MAX_HEADER_BYTES, ProtocolError, _buffer

PIECE_BYTES = 256 * 1024  # a second at 250 kB/s: well inside a peer's patience; a few thousand a second on loopback
MARK = b"\xc1"
_PLACE = struct.Struct("<BHHQ")  # flags, frame index, frame count, offset in the frame
_FIRST, _FRAME_END = 1, 2  # flags: the message's first piece; the last piece of its frame


def pieces(frames: Sequence[Any]) -> list[list] | None:
    """``frames`` (a message, as :func:`transports.wire.encode` makes it) as pieces, each the frames of
    one message to send, in order; None for a message small enough to go whole."""
    views = [_buffer(f) for f in frames]
    if sum(len(v) for v in views) <= PIECE_BYTES:
        return None
    out: list[list] = []
    for i, view in enumerate(views):
        for start in range(0, max(len(view), 1), PIECE_BYTES):  # an empty frame is one empty piece
            flags = (0 if out else _FIRST) | (_FRAME_END if start + PIECE_BYTES >= len(view) else 0)
            out.append([MARK, _PLACE.pack(flags, i, len(views), start), view[start : start + PIECE_BYTES]])
    return out


def is_piece(frames: Sequence[Any]) -> bool:
    if len(frames) != 3:
        return False
    first = _buffer(frames[0])
    return len(first) == 1 and first[0] == MARK[0]  # a look at one byte, no copy of a header


class Reassembly:
    """One sender's message as its pieces come, in order: :meth:`add` returns the whole message's frames once
    its last piece is in, else None. A message the sender cut short (its pipe was full) is dropped when the
    next one begins; a piece out of place raises ProtocolError."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._reset()

    def add(self, piece: Sequence[Any]) -> list[bytearray] | None:
        place, data = _buffer(piece[1]), _buffer(piece[2])
        if len(place) != _PLACE.size:
            raise self._broken(f"a piece's place is {len(place)} bytes, not {_PLACE.size}")
        flags, index, count, offset = _PLACE.unpack(place)
        if flags & _FIRST:
            self._reset()  # a message still in progress was cut short: it is dropped
            if not 1 <= count <= 1 + MAX_ARRAYS:
                raise self._broken(f"a message of {count} frames; at most a header and {MAX_ARRAYS} arrays")
            self._count = count
        if count != self._count or index != len(self._frames) or offset != len(self._part):
            raise self._broken(f"a piece of frame {index} of {count} at byte {offset} out of place")
        header = index == 0  # the header frame has its own cap; the arrays' frames, one cap in all
        if (len(self._part) + len(data) > MAX_HEADER_BYTES) if header else (self._bytes + len(data) > self.max_bytes):
            raise self._broken(f"a message in pieces over its cap ({MAX_HEADER_BYTES} header, {self.max_bytes} arrays)")
        self._bytes += 0 if header else len(data)
        self._part += data
        if flags & _FRAME_END:
            self._frames.append(self._part)
            self._part = bytearray()
        if len(self._frames) < self._count:
            return None
        whole = self._frames
        self._reset()
        return whole

    def _broken(self, why: str) -> ProtocolError:
        self._reset()
        return ProtocolError(why)

    def _reset(self) -> None:
        self._frames: list[bytearray] = []  # the frames put together so far
        self._part = bytearray()  # the frame in progress
        self._count = 0  # the message's frames; 0: waiting for a first piece
        self._bytes = 0  # of the arrays' frames, in all

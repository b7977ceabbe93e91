"""The wire: how a :class:`Message` becomes frames and back, safely.

A message on the wire is a list of frames::

    frame 0      msgpack {"v": WIRE_VERSION, "kind": str, "header": {...},
                          "arrays": [{"name": str, "dtype": str, "shape": [int, ...]}, ...]}
    frame 1..n   the raw bytes of each array, C order, in descriptor order

Arrays are never pickled, nor copied on the way out (a frame is a ``memoryview`` of the array)
or in (a decoded array is a read-only view of its frame). :data:`WIRE_VERSION` versions this
envelope alone; what a kind, a header and the arrays may be is :mod:`transports.header`'s, whose
public names this module re-exports (the application declares its task headers with them).

Frames come from the network, so :func:`decode` checks everything (docs/how-it-works.md lists what)
before it builds an array; every failure is a :class:`ProtocolError` that says what was wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from transports.base import Message
from transports.header import (
    DTYPES,
    MAX_ARRAYS,
    MAX_HEADER_BYTES,
    MAX_LIST_LEN,
    MAX_MAP_LEN,
    Int,
    ProtocolError,
    VersionMismatch,
    check_array_names,
    check_descriptor,
    check_header,
    check_message,
    pack,
)
from transports.header import PROGRESS as PROGRESS  # re-exported: the application's names
from transports.header import SESSION_KINDS as SESSION_KINDS
from transports.header import Num as Num
from transports.header import check_fields as check_fields
from transports.header import error_reply as error_reply
from transports.header import progress as progress

WIRE_VERSION = 1

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB of array data per message
# Bounds for msgpack itself, so a hostile header cannot make the parser allocate much.
_UNPACK_LIMITS = dict(
    max_str_len=MAX_HEADER_BYTES,
    max_bin_len=0,  # headers carry no binary blobs; arrays travel as frames
    max_array_len=MAX_LIST_LEN,
    max_map_len=MAX_MAP_LEN,
    max_ext_len=0,  # no extension types (timestamps, custom objects)
)


def encode(msg: Message) -> list[bytes | memoryview]:
    """Message -> frames: a msgpack header then one zero-copy buffer per array. The buffers alias the arrays'
    memory, so do not modify an array until the send is done (the master naturally waits for the reply first)."""
    check_message(msg)
    descriptors = []
    buffers: list[bytes | memoryview] = []
    for name, a in msg.arrays.items():
        a = np.asarray(a, dtype=DTYPES[a.dtype.name], order="C")  # a copy only if not C-contiguous
        descriptors.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape)})
        # reshape(-1).view(uint8): a flat byte view of the same memory, fine for 0-d and empty arrays
        buffers.append(memoryview(a.reshape(-1).view(np.uint8)))
    envelope = {"v": WIRE_VERSION, "kind": msg.kind, "header": msg.header, "arrays": descriptors}
    return [pack(msg.kind, envelope), *buffers]


def _buffer(frame: Any) -> memoryview:
    """A flat byte view of one frame: bytes, bytearray, memoryview or a zmq.Frame (copy=False)."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes its memory as .buffer
    try:
        view = memoryview(buf)
        return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")
    except TypeError as e:
        raise ProtocolError(f"a frame must be a contiguous bytes-like object, got {type(frame).__name__}") from e


def _parse_envelope(head: memoryview) -> dict:
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {len(head)} bytes, over the {MAX_HEADER_BYTES} limit")
    try:
        env = msgpack.unpackb(head, raw=False, strict_map_key=True, use_list=True, **_UNPACK_LIMITS)
    except Exception as e:  # the parser's many error types all mean one thing here: not our header
        raise ProtocolError(f"header frame is not valid msgpack within limits: {type(e).__name__}: {e}") from e
    if not isinstance(env, dict):
        raise ProtocolError(f"header frame must be a msgpack map, got {type(env).__name__}")
    # the version first: a future version may have another layout, and deserves a clear message
    if "v" not in env:
        raise ProtocolError("header has no wire version 'v'; is the peer speaking this wire at all?")
    if not Int.accepts(env["v"]) or env["v"] != WIRE_VERSION:
        raise VersionMismatch("wire", env["v"], WIRE_VERSION)
    expected = {"v", "kind", "header", "arrays"}
    if set(env) != expected:
        raise ProtocolError(f"header keys must be exactly {sorted(expected)}, got {sorted(map(str, env))}")
    return env


def _parse_arrays(kind: str, descriptors: Any, frames: Sequence[Any], max_bytes: int) -> dict[str, np.ndarray]:
    if not isinstance(descriptors, list) or len(descriptors) > MAX_ARRAYS:
        raise ProtocolError(f"{kind}: 'arrays' must be a list of at most {MAX_ARRAYS} descriptors")
    parsed = [check_descriptor(kind, i, d) for i, d in enumerate(descriptors)]
    check_array_names(kind, [p[0] for p in parsed])
    total = sum(p[3] for p in parsed)
    if total > max_bytes:
        raise ProtocolError(
            f"{kind}: arrays declare {total} bytes in all, over the limit of {max_bytes} bytes "
            f"(raise max_message_bytes if this is intended)"
        )
    if len(frames) != len(parsed):
        raise ProtocolError(f"{kind}: header describes {len(parsed)} array(s) but {len(frames)} array frame(s) arrived")
    arrays: dict[str, np.ndarray] = {}
    for (name, dtype, shape, nbytes), frame in zip(parsed, frames, strict=True):
        buf = _buffer(frame)
        if len(buf) != nbytes:
            raise ProtocolError(
                f"{kind}: array {name!r} declares shape {list(shape)} {dtype.name} = {nbytes} bytes, "
                f"but its frame has {len(buf)} bytes"
            )
        a = np.frombuffer(buf, dtype=dtype).reshape(shape)
        if not a.flags.aligned:  # rare: keep BLAS on its fast path
            a = a.copy()
        a.flags.writeable = False
        arrays[name] = a
    return arrays


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Frames (bytes-like, or zmq Frames received with ``copy=False``) -> Message, validating everything before
    any array is built; its arrays are read-only views of the frames. Raises :class:`ProtocolError` (or its
    subclass :class:`VersionMismatch`) and nothing else on bad input."""
    if len(frames) == 0:
        raise ProtocolError("empty message: no frames at all")
    env = _parse_envelope(_buffer(frames[0]))
    kind, header = env["kind"], env["header"]
    check_header(kind, header)
    return Message(kind, header, _parse_arrays(kind, env["arrays"], frames[1:], max_bytes))


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total bytes of a list of frames, as they cross the wire (header + arrays)."""
    return sum(len(_buffer(f)) for f in frames)

"""The wire protocol: how a :class:`Message` becomes frames and back, safely.

A message on the wire is a list of frames::

    frame 0      msgpack {"v": PROTOCOL_VERSION, "kind": str, "header": {...},
                          "arrays": [{"name": str, "dtype": str, "shape": [int, ...]}, ...]}
    frame 1..n   the raw bytes of each array, C order, in descriptor order

Arrays are never pickled and never copied on the way out (a frame is a
``memoryview`` of the array's own memory) nor on the way in (a decoded array is a
read-only ``np.frombuffer`` view of its frame).

Frames come from the network, so :func:`decode` trusts nothing. In this order it
checks: the header frame's size; that it parses as plain msgpack (limits on every
string, list, map; no extension types); the protocol version; exact envelope
keys; a known kind; that kind's header keys and value types (:data:`HEADER_SCHEMA`);
array names for that kind; dtypes against an allow-list; shapes (non-negative
ints, rank <= 6); the declared total against ``max_bytes``; the number of frames;
and each frame's length against its shape. Only then does it build arrays. Every
failure is a :class:`ProtocolError` whose message says what was wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from transports.base import KINDS, PROTOCOL_VERSION, Handler, Message

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB of array data per message
MAX_HEADER_BYTES = 1 << 20  # the msgpack frame: a header is small, a megabyte is generous
MAX_RANK = 6
MAX_ARRAYS = 16

# dtype name on the wire -> the exact numpy dtype (little-endian, as on every machine we target)
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
}

# Bounds for msgpack itself, so a hostile header cannot make the parser allocate much.
_UNPACK_LIMITS = dict(
    max_str_len=MAX_HEADER_BYTES,
    max_bin_len=0,  # headers carry no binary blobs; arrays travel as frames
    max_array_len=100_000,
    max_map_len=1_000,
    max_ext_len=0,  # no extension types (timestamps, custom objects)
)


class ProtocolError(ValueError):
    """A message that does not follow the wire protocol; the text says what was wrong."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version. ``theirs`` and ``ours`` are the two versions."""

    def __init__(self, theirs: object, ours: int = PROTOCOL_VERSION) -> None:
        super().__init__(
            f"protocol version mismatch: the peer speaks version {theirs!r}, this side speaks "
            f"version {ours}; install the same tinyconv version on the master and every worker"
        )
        self.theirs = theirs
        self.ours = ours


# ---- header schema ------------------------------------------------------------
# A type spec is a tuple of accepted Python types. bool is a subclass of int, so
# integer fields name _Int, which rejects bools explicitly (see _type_ok).


class _Int:
    """Marker: an int that is not a bool."""


class _Num:
    """Marker: an int or float that is not a bool."""


class _NumList:
    """Marker: a list of numbers."""


_TYPE_NAMES = {
    _Int: "int",
    _Num: "number",
    _NumList: "list of numbers",
    str: "str",
    bool: "bool",
    dict: "map",
    list: "list",
}

# kind -> (required keys, optional keys), each key -> its type
HEADER_SCHEMA: dict[str, tuple[dict[str, type], dict[str, type]]] = {
    "hello": ({"protocol": _Int, "backend": str, "device": dict, "pid": _Int, "hostname": str}, {}),
    "welcome": ({"index": _Int, "heartbeat_s": _Num}, {}),
    "calibrate": ({"task": _Int, "layers": list, "repeats": _Int}, {}),
    "conv_forward": (
        {"task": _Int, "step": _Int, "layer": _Int, "stride": _Int, "padding": _Int, "need_dx": bool},
        # a fused tail (tinyconv/block.py), the worker checks it; part "conv" / "tail" when split by input channels
        {"tail": list, "own": _NumList, "part": str, "ext": _NumList, "give": _NumList},
    ),
    "conv_backward": (
        {"task": _Int, "step": _Int, "layer": _Int},
        {"dy_from": _Int, "part": str},
    ),
    "result": (
        {"task": _Int, "compute_s": _Num},
        {"step": _Int, "layer": _Int, "times": _NumList},
    ),
    "error": ({"message": str}, {"task": _Int, "step": _Int, "layer": _Int}),
    "heartbeat": ({}, {}),
    "shutdown": ({"reason": str}, {}),
}

# kind -> (required array names, allowed array names)
ARRAY_SCHEMA: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # which arrays each part takes, the worker checks (tinyconv/worker.py)
    "conv_forward": (frozenset(), frozenset({"x", "w", "b", "sum"})),
    "conv_backward": (frozenset(), frozenset({"dy", "dyc_lo", "dyc_hi"})),
    "result": (frozenset(), frozenset({"y", "p_lo", "p_hi", "dw", "db", "dx", "dyc"})),
}
_NO_ARRAYS = (frozenset(), frozenset())

assert set(HEADER_SCHEMA) == set(KINDS), "every kind needs a header schema"


def _type_ok(value: Any, spec: type) -> bool:
    if spec is _Int:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec is _Num:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec is _NumList:
        return isinstance(value, list) and all(_type_ok(v, _Num) for v in value)
    return isinstance(value, spec)


def check_header(kind: str, header: Any) -> None:
    """Raise ProtocolError unless ``header`` has exactly the keys and types ``kind`` needs."""
    if kind not in HEADER_SCHEMA:
        raise ProtocolError(f"unknown message kind {kind!r}; known kinds: {', '.join(KINDS)}")
    if not isinstance(header, dict):
        raise ProtocolError(f"{kind}: header must be a map, got {type(header).__name__}")
    required, optional = HEADER_SCHEMA[kind]
    missing = sorted(set(required) - set(header))
    if missing:
        raise ProtocolError(f"{kind}: header is missing {', '.join(missing)}")
    unknown = sorted(str(k) for k in set(header) - set(required) - set(optional))
    if unknown:
        raise ProtocolError(
            f"{kind}: unexpected header key(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted({**required, **optional}))}"
        )
    for key, value in header.items():
        spec = required.get(key) or optional[key]
        if not _type_ok(value, spec):
            raise ProtocolError(f"{kind}: header {key!r} must be {_TYPE_NAMES[spec]}, got {type(value).__name__}")


def _check_array_names(kind: str, names: Sequence[str]) -> None:
    required, allowed = ARRAY_SCHEMA.get(kind, _NO_ARRAYS)
    if len(set(names)) != len(names):
        raise ProtocolError(f"{kind}: duplicate array names in {list(names)}")
    missing = sorted(required - set(names))
    if missing:
        raise ProtocolError(f"{kind}: missing array(s) {', '.join(missing)}")
    extra = sorted(set(names) - allowed)
    if extra:
        hint = f"allowed: {', '.join(sorted(allowed))}" if allowed else "it carries no arrays"
        raise ProtocolError(f"{kind}: unexpected array(s) {', '.join(extra)}; {hint}")


def check_message(msg: Message) -> None:
    """Validate a Message about to be sent (kind, header schema, array names and dtypes).

    ``encode`` calls this; the in-process transport calls it too, so a malformed
    message fails the same way whichever transport carries it.
    """
    if not isinstance(msg, Message):
        raise ProtocolError(f"expected a Message, got {type(msg).__name__}")
    check_header(msg.kind, msg.header)
    _check_array_names(msg.kind, list(msg.arrays))
    for name, a in msg.arrays.items():
        if not isinstance(a, np.ndarray):
            raise ProtocolError(f"{msg.kind}: array {name!r} is a {type(a).__name__}, not a numpy array")
        if a.dtype.name not in DTYPES or a.dtype.byteorder == ">":
            raise ProtocolError(
                f"{msg.kind}: array {name!r} has dtype {a.dtype}; the wire carries only "
                f"{', '.join(DTYPES)} (cast it, e.g. .astype(np.float32))"
            )
        if a.ndim > MAX_RANK:
            raise ProtocolError(f"{msg.kind}: array {name!r} has rank {a.ndim} > {MAX_RANK}")


# ---- encode -----------------------------------------------------------------------


def encode(msg: Message) -> list[bytes | memoryview]:
    """Message -> frames: a msgpack header then one zero-copy buffer per array.

    The buffers alias the arrays' memory, so do not modify an array until the
    send is done (the master naturally waits for the reply first).
    """
    check_message(msg)
    descriptors = []
    buffers: list[bytes | memoryview] = []
    for name, a in msg.arrays.items():
        a = np.asarray(a, dtype=DTYPES[a.dtype.name], order="C")  # a copy only if not C-contiguous
        descriptors.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape)})
        # reshape(-1).view(uint8): a flat byte view of the same memory, fine for 0-d and empty arrays
        buffers.append(memoryview(a.reshape(-1).view(np.uint8)))
    envelope = {"v": PROTOCOL_VERSION, "kind": msg.kind, "header": msg.header, "arrays": descriptors}
    try:
        head = msgpack.packb(envelope, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(
            f"{msg.kind}: header is not plain data ({e}); use int, float, bool, str, list and dict "
            f"(convert numpy scalars with int() / float())"
        ) from e
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{msg.kind}: header is {len(head)} bytes, over the {MAX_HEADER_BYTES} limit")
    return [head, *buffers]


# ---- decode -----------------------------------------------------------------------


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
        raise ProtocolError("header has no protocol version 'v'; is the peer a tinyconv process?")
    if not _type_ok(env["v"], _Int) or env["v"] != PROTOCOL_VERSION:
        raise VersionMismatch(env["v"])
    expected = {"v", "kind", "header", "arrays"}
    if set(env) != expected:
        raise ProtocolError(f"header keys must be exactly {sorted(expected)}, got {sorted(map(str, env))}")
    if not isinstance(env["kind"], str):
        raise ProtocolError(f"'kind' must be a str, got {type(env['kind']).__name__}")
    return env


def _parse_descriptor(kind: str, i: int, d: Any) -> tuple[str, np.dtype, tuple[int, ...], int]:
    """One array descriptor -> (name, dtype, shape, nbytes), all checked."""
    if not isinstance(d, dict) or set(d) != {"name", "dtype", "shape"}:
        raise ProtocolError(f"{kind}: array descriptor {i} must be a map with keys name, dtype, shape")
    name, dtype, shape = d["name"], d["dtype"], d["shape"]
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{kind}: array descriptor {i} needs a non-empty str name")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"{kind}: array {name!r} has dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise ProtocolError(f"{kind}: array {name!r} shape must be a list of at most {MAX_RANK} ints")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ProtocolError(f"{kind}: array {name!r} shape {shape!r} must hold non-negative ints")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize  # Python ints: no overflow
    return name, DTYPES[dtype], tuple(shape), nbytes


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Frames -> Message, validating everything before any array is built.

    ``frames`` are bytes-like objects or zmq Frames received with ``copy=False``.
    Arrays are read-only views of the frames (copied only if a frame's memory is
    misaligned for its dtype). Raises :class:`ProtocolError` (or its subclass
    :class:`VersionMismatch`) and nothing else on bad input.
    """
    if len(frames) == 0:
        raise ProtocolError("empty message: no frames at all")
    env = _parse_envelope(_buffer(frames[0]))
    kind, header, descriptors = env["kind"], env["header"], env["arrays"]
    check_header(kind, header)
    if not isinstance(descriptors, list) or len(descriptors) > MAX_ARRAYS:
        raise ProtocolError(f"{kind}: 'arrays' must be a list of at most {MAX_ARRAYS} descriptors")
    parsed = [_parse_descriptor(kind, i, d) for i, d in enumerate(descriptors)]
    _check_array_names(kind, [p[0] for p in parsed])
    total = sum(p[3] for p in parsed)
    if total > max_bytes:
        raise ProtocolError(
            f"{kind}: arrays declare {total} bytes in all, over the limit of {max_bytes} bytes "
            f"(raise max_message_bytes if this is intended)"
        )
    if len(frames) != 1 + len(parsed):
        raise ProtocolError(
            f"{kind}: header describes {len(parsed)} array(s) but {len(frames) - 1} array frame(s) arrived"
        )
    arrays: dict[str, np.ndarray] = {}
    for (name, dtype, shape, nbytes), frame in zip(parsed, frames[1:], strict=True):
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
    return Message(kind, header, arrays)


# ---- serving: replies always follow the protocol ----------------------------------------


def error_reply(request: Message | None, text: str) -> Message:
    """An ``error`` message answering ``request``, carrying its task, step and layer
    (when known and well-formed) so the master can tell which task failed."""
    header: dict[str, Any] = {"message": text}
    if request is not None and isinstance(request.header, dict):
        for key in ("task", "step", "layer"):
            if _type_ok(request.header.get(key), _Int):
                header[key] = request.header[key]
    return Message("error", header)


def call_handler(handler: Handler, msg: Message) -> Message | None:
    """``handler.handle(msg)``, made safe for a worker loop.

    An exception becomes an ``error`` reply, and so does a reply that breaks the
    protocol, so a bad task (or a handler bug) never kills the worker and the
    master always gets a message it can decode.
    """
    try:
        reply = handler.handle(msg)
        if reply is not None:
            check_message(reply)
        return reply
    except ProtocolError as e:
        return error_reply(msg, f"{msg.kind}: the worker produced an invalid reply: {e}")
    except Exception as e:  # report and keep serving; the traceback is no use to the master
        return error_reply(msg, f"{msg.kind} failed: {type(e).__name__}: {e}")


# ---- byte counting (metrics) -------------------------------------------------------


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total bytes of a list of frames, as they cross the wire (header + arrays)."""
    return sum(len(_buffer(f)) for f in frames)


def message_nbytes(msg: Message) -> int:
    """Bytes ``msg`` takes on the wire: its encoded header plus its array data."""
    return frames_nbytes(encode(msg))


__all__ = [
    "DEFAULT_MAX_BYTES",
    "DTYPES",
    "HEADER_SCHEMA",
    "ARRAY_SCHEMA",
    "ProtocolError",
    "VersionMismatch",
    "check_header",
    "check_message",
    "error_reply",
    "call_handler",
    "encode",
    "decode",
    "frames_nbytes",
    "message_nbytes",
]

"""What a message's kind, header and arrays may be: the rules the wire applies, and the session's kinds
(docs/writing-a-transport.md, "Session kinds and task kinds"). A header is plain data of exact types: a
numpy scalar or a tuple would arrive as something else, so they are refused rather than changed.
:mod:`transports.wire` re-exports the public names; import them from there.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from transports.base import Message

MAX_LIST_LEN = 100_000  # items in one list of a header
MAX_MAP_LEN = 1_000  # keys in one map of a header
MAX_DEPTH = 32  # lists and maps nested in a header
MAX_HEADER_BYTES = 1 << 20  # the msgpack frame: a header is small, a megabyte is generous
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_RANK = 6  # dimensions of one array
MAX_ARRAYS = 16  # arrays in one message

# dtype name on the wire -> the exact numpy dtype (little-endian, as on every machine we target)
# (float16 and uint16 carry the narrowed words of --wire-precision: fp16, and bf16's top 2 bytes of a float32)
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "float16": np.dtype("<f2"),
    "uint16": np.dtype("<u2"),
}


class ProtocolError(ValueError):
    """A message that does not follow the wire; the text says what was wrong."""


class VersionMismatch(ProtocolError):
    """Two sides speak different versions of ``what`` (the wire, or a task protocol); ``peer`` and ``here``
    name the sides in the text."""

    def __init__(self, what: str, theirs: object, ours: int, peer: str = "the peer", here: str = "this side") -> None:
        super().__init__(
            f"{what} version mismatch: {peer} speaks version {theirs!r}, {here} version {ours}; "
            "run the same release on the master and every worker"
        )
        self.what, self.theirs, self.ours = what, theirs, ours


class _Spec(type):
    """A header type for :func:`check_fields` that takes its ``types`` but never a bool
    (``isinstance(True, Int)`` is False); ``Int.accepts(value)`` is the same test."""

    def __instancecheck__(cls, value: Any) -> bool:
        return isinstance(value, cls.types) and not isinstance(value, bool)

    def accepts(cls, value: Any) -> bool:
        return isinstance(value, cls)


class Int(metaclass=_Spec):
    description, types = "int", int


class Num(metaclass=_Spec):
    description, types = "number", (int, float)


def _type_name(spec: type) -> str:
    return "map" if spec is dict else getattr(spec, "description", spec.__name__)


def check_fields(what: str, header: Any, required: dict[str, type], optional: dict[str, type]) -> None:
    """Raise ProtocolError unless ``header`` has every ``required`` key, no key but those and the ``optional``
    ones, and each value of its key's type: anything ``isinstance`` takes (:class:`Int`, :class:`Num` refuse
    bools). ``what`` names the message kind in the error text."""
    if not isinstance(header, dict):
        raise ProtocolError(f"{what}: header must be a map, got {type(header).__name__}")
    missing = [key for key in required if key not in header]
    if missing:
        wanted = ", ".join(f"{key!r} ({_type_name(required[key])})" for key in missing)
        raise ProtocolError(f"{what}: header is missing {wanted}")
    unknown = sorted(str(key) for key in header if key not in required and key not in optional)
    if unknown:
        allowed = sorted({**required, **optional})
        hint = f"allowed: {', '.join(allowed)}" if allowed else "it takes none"
        raise ProtocolError(f"{what}: unexpected header key(s) {', '.join(unknown)}; {hint}")
    for key, value in header.items():
        spec = required[key] if key in required else optional[key]
        if not isinstance(value, spec):
            raise ProtocolError(f"{what}: header {key!r} must be {_type_name(spec)}, got {type(value).__name__}")


# The transport's own kinds: kind -> (required keys, optional keys). They carry no arrays.
SESSION_HEADERS: dict[str, tuple[dict[str, type], dict[str, type]]] = {
    "hello": ({"protocol": Int, "backend": str, "device": dict, "pid": Int, "hostname": str}, {"secret": str}),
    "welcome": ({"index": Int, "heartbeat_s": Num}, {}),
    "heartbeat": ({}, {}),
    "shutdown": ({"reason": str}, {}),
    "error": ({"message": str}, {"task": Int}),
    "started": ({"task": Int}, {}),
    "computed": ({"task": Int}, {}),
}
SESSION_KINDS = frozenset(SESSION_HEADERS)
# a worker's word on a task it was given: it has it whole and starts computing; it is done, its reply follows
PROGRESS = frozenset({"started", "computed"})

_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what msgpack can carry
_SCALARS = (type(None), bool, int, float, str)


def _not_plain(value: Any, depth: int) -> tuple[str, list[Any]] | None:
    """What in ``value`` is not plain data, as (the problem, the keys down to it), or None if nothing is."""
    kind = type(value)  # exact types: numpy scalars and other subclasses would change on the way
    if kind in _SCALARS:
        if kind is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            return f"the int {value} does not fit in 64 bits", []
        return None
    if kind is list or kind is dict:
        if depth >= MAX_DEPTH:
            return f"lists and maps nest deeper than {MAX_DEPTH} levels", []
        limit = MAX_LIST_LEN if kind is list else MAX_MAP_LEN
        if len(value) > limit:
            return f"a {kind.__name__} of {len(value)} items, over the {limit} limit", []
        for key, item in enumerate(value) if kind is list else value.items():
            if type(key) is not str and kind is dict:
                return f"the key {key!r} is not a str", []
            if (found := _not_plain(item, depth + 1)) is not None:
                return found[0], [key, *found[1]]
        return None
    hint = ""
    if isinstance(value, np.generic):
        hint = " (a numpy scalar: use int(), float() or bool())"
    elif kind is tuple:
        hint = " (use a list)"
    return f"a {kind.__module__}.{kind.__qualname__}{hint}".replace("builtins.", ""), []


def check_kind(kind: Any) -> None:
    """Raise ProtocolError unless ``kind`` is a short identifier (:data:`KIND_PATTERN`)."""
    if not isinstance(kind, str):
        raise ProtocolError(f"'kind' must be a str, got {type(kind).__name__}")
    if not KIND_PATTERN.fullmatch(kind):
        raise ProtocolError(
            f"message kind {kind[:40]!r} is not a short identifier: a lowercase letter, then at most 31 "
            "lowercase letters, digits or underscores"
        )


def check_header(kind: Any, header: Any) -> None:
    """Raise ProtocolError unless ``kind`` passes :func:`check_kind` and ``header`` is plain data that, for a
    session kind, follows its schema."""
    check_kind(kind)
    if type(header) is not dict:
        raise ProtocolError(f"{kind}: header must be a map, got {type(header).__name__}")
    if (found := _not_plain(header, 0)) is not None:
        where = "header" + "".join(f"[{key!r}]" for key in found[1])
        raise ProtocolError(
            f"{kind}: {where} is not plain data: {found[0]}; a header holds only None, bool, int, "
            "float, str, lists and maps with str keys"
        )
    if kind in SESSION_KINDS:
        check_fields(kind, header, *SESSION_HEADERS[kind])


def check_array_names(kind: str, names: Sequence[Any]) -> None:
    """Raise ProtocolError unless ``names`` are at most MAX_ARRAYS distinct non-empty strs (none for a session kind)."""
    if len(names) > MAX_ARRAYS:
        raise ProtocolError(f"{kind}: {len(names)} arrays, at most {MAX_ARRAYS} allowed")
    if names and kind in SESSION_KINDS:
        raise ProtocolError(f"{kind}: unexpected array(s) {', '.join(map(str, names))}; it carries no arrays")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"{kind}: array names must be non-empty str, got {name!r}")
    if len(set(names)) != len(names):
        raise ProtocolError(f"{kind}: duplicate array names in {list(names)}")


def check_descriptor(kind: str, i: int, d: Any) -> tuple[str, np.dtype, tuple[int, ...], int]:
    """One received array descriptor -> (name, dtype, shape, nbytes), checked (the names are
    :func:`check_array_names`'s); ``i`` is its place."""
    if not isinstance(d, dict) or set(d) != {"name", "dtype", "shape"}:
        raise ProtocolError(f"{kind}: array descriptor {i} must be a map with keys name, dtype, shape")
    name, dtype, shape = d["name"], d["dtype"], d["shape"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"{kind}: array {name!r} has dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise ProtocolError(f"{kind}: array {name!r} shape must be a list of at most {MAX_RANK} ints")
    if not all(Int.accepts(s) and s >= 0 for s in shape):
        raise ProtocolError(f"{kind}: array {name!r} shape {shape!r} must hold non-negative ints")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize  # Python ints: no overflow
    return name, DTYPES[dtype], tuple(shape), nbytes


def check_arrays(kind: str, arrays: Any) -> None:
    """Raise ProtocolError unless ``arrays``, about to be sent, map names to numpy arrays the wire carries."""
    if not isinstance(arrays, dict):
        raise ProtocolError(f"{kind}: arrays must be a dict of name -> numpy array")
    check_array_names(kind, list(arrays))
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray):
            raise ProtocolError(f"{kind}: array {name!r} is a {type(a).__name__}, not a numpy array")
        if a.dtype.name not in DTYPES or a.dtype.byteorder == ">":
            raise ProtocolError(
                f"{kind}: array {name!r} has dtype {a.dtype}; the wire carries only "
                f"{', '.join(DTYPES)} (cast it, e.g. .astype(np.float32))"
            )
        if a.ndim > MAX_RANK:
            raise ProtocolError(f"{kind}: array {name!r} has rank {a.ndim} > {MAX_RANK}")


def pack(kind: str, obj: Any) -> bytes:
    """``obj`` (a header, or the envelope holding it) as msgpack, within MAX_HEADER_BYTES."""
    try:
        packed = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # e.g. a str that is not valid unicode
        raise ProtocolError(f"{kind}: header cannot be packed: {type(e).__name__}: {e}") from e
    if len(packed) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{kind}: header is {len(packed)} bytes, over the {MAX_HEADER_BYTES} limit")
    return packed


def check_message(msg: Message) -> None:
    """Validate a Message about to be sent: kind, header (its schema for a session kind), array names,
    dtypes and ranks, and that its header packs into MAX_HEADER_BYTES. The in-process transport calls it
    too, so a malformed message fails the same way whichever transport carries it."""
    if not isinstance(msg, Message):
        raise ProtocolError(f"expected a Message, got {type(msg).__name__}")
    check_header(msg.kind, msg.header)
    check_arrays(msg.kind, msg.arrays)
    pack(msg.kind, msg.header)


def progress(kind: str, request: Message) -> Message | None:
    """``kind`` ("started" or "computed") of the task ``request``, naming its ``task``; None without an int one."""
    task = request.header.get("task") if isinstance(request.header, dict) else None
    return Message(kind, {"task": task}) if Int.accepts(task) else None


def error_reply(request: Message | None, text: str) -> Message:
    """An ``error`` message answering ``request``, echoing its header's ``task`` when that is
    an int, so the master can tell which task failed."""
    header: dict[str, Any] = {"message": text}
    if request is not None and isinstance(request.header, dict) and Int.accepts(request.header.get("task")):
        header["task"] = request.header["task"]
    return Message("error", header)

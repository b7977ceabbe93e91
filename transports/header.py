"""What a message's kind and header may be: the rules the wire applies before anything else.

* A kind is a short identifier (:data:`KIND_PATTERN`).
* A header is plain data: a map with str keys whose values are None, bool, int,
  float, str, lists and maps, nested at most :data:`MAX_DEPTH` deep. Exact types:
  a numpy scalar or a tuple would arrive as something else on the other side, so
  they are refused here rather than changed on the way.
* The transport's own *session* kinds (:data:`SESSION_KINDS`) have fixed header
  schemas. Every other kind is a task, whose header only the application reads;
  the application declares its schemas with the same helper, :func:`check_fields`
  with :class:`Int` and :class:`Num`.

:mod:`transports.wire` re-exports the public names; import them from there.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

MAX_LIST_LEN = 100_000  # items in one list of a header
MAX_MAP_LEN = 1_000  # keys in one map of a header
MAX_DEPTH = 32  # lists and maps nested in a header
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")


class ProtocolError(ValueError):
    """A message that does not follow the wire; the text says what was wrong."""


class VersionMismatch(ProtocolError):
    """Two sides speak different versions of ``what`` (the wire, or a task protocol).

    ``theirs`` and ``ours`` are the two versions; ``peer`` and ``here`` name the
    two sides in the text.
    """

    def __init__(self, what: str, theirs: object, ours: int, peer: str = "the peer", here: str = "this side") -> None:
        super().__init__(
            f"{what} version mismatch: {peer} speaks version {theirs!r}, {here} version {ours}; "
            "run the same release on the master and every worker"
        )
        self.what = what
        self.theirs = theirs
        self.ours = ours


# ---- schemas ------------------------------------------------------------------------------


class _Spec(type):
    """A header type that isinstance checks with the class's own ``accepts``."""

    def __instancecheck__(cls, value: Any) -> bool:
        return cls.accepts(value)


class Int(metaclass=_Spec):
    """For :func:`check_fields`: an int that is not a bool (``isinstance(True, Int)`` is False)."""

    description = "int"

    @staticmethod
    def accepts(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)


class Num(metaclass=_Spec):
    """For :func:`check_fields`: an int or a float, not a bool."""

    description = "number"

    @staticmethod
    def accepts(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)


_TYPE_NAMES = {dict: "map", list: "list", str: "str", bool: "bool", float: "float", int: "int"}


def _type_name(spec: type) -> str:
    return _TYPE_NAMES.get(spec) or getattr(spec, "description", spec.__name__)


def check_fields(what: str, header: Any, required: dict[str, type], optional: dict[str, type]) -> None:
    """Raise ProtocolError unless ``header`` has every ``required`` key, no key but those and
    the ``optional`` ones, and each value of its key's type.

    A type is anything ``isinstance`` takes: ``str``, ``bool``, ``list``, ``dict``, or
    :class:`Int` / :class:`Num`, which refuse bools. ``what`` names the message kind
    in the error text.
    """
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
    "hello": ({"protocol": Int, "backend": str, "device": dict, "pid": Int, "hostname": str}, {}),
    "welcome": ({"index": Int, "heartbeat_s": Num}, {}),
    "heartbeat": ({}, {}),
    "shutdown": ({"reason": str}, {}),
    "error": ({"message": str}, {"task": Int}),
}
SESSION_KINDS = frozenset(SESSION_HEADERS)


# ---- plain data -------------------------------------------------------------------------

_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what msgpack can carry
_SCALARS = (type(None), bool, int, float, str)


class _NotPlain(Exception):
    """Raised inside :func:`_walk`; ``path`` collects the keys on the way out."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.path: list[Any] = []


def _walk(value: Any, depth: int) -> None:
    kind = type(value)  # exact types: numpy scalars and other subclasses would change on the way
    if kind in _SCALARS:
        if kind is int and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise _NotPlain(f"the int {value} does not fit in 64 bits")
        return
    if kind is list or kind is dict:
        if depth >= MAX_DEPTH:
            raise _NotPlain(f"lists and maps nest deeper than {MAX_DEPTH} levels")
        limit = MAX_LIST_LEN if kind is list else MAX_MAP_LEN
        if len(value) > limit:
            raise _NotPlain(f"a {kind.__name__} of {len(value)} items, over the {limit} limit")
        for key, item in enumerate(value) if kind is list else value.items():
            if type(key) is not str and kind is dict:
                raise _NotPlain(f"the key {key!r} is not a str")
            try:
                _walk(item, depth + 1)
            except _NotPlain as e:
                e.path.append(key)
                raise
        return
    hint = ""
    if isinstance(value, np.generic):
        hint = " (a numpy scalar: use int(), float() or bool())"
    elif kind is tuple:
        hint = " (use a list)"
    raise _NotPlain(f"a {kind.__module__}.{kind.__qualname__}{hint}".replace("builtins.", ""))


def _check_plain(what: str, header: Any) -> None:
    if type(header) is not dict:
        raise ProtocolError(f"{what}: header must be a map, got {type(header).__name__}")
    try:
        _walk(header, 0)
    except _NotPlain as e:
        where = "header" + "".join(f"[{key!r}]" for key in reversed(e.path))
        raise ProtocolError(
            f"{what}: {where} is not plain data: {e.problem}; a header holds only None, bool, int, "
            "float, str, lists and maps with str keys"
        ) from None


def check_kind(kind: Any) -> None:
    """Raise ProtocolError unless ``kind`` is a short identifier (:data:`KIND_PATTERN`)."""
    if not isinstance(kind, str):
        raise ProtocolError(f"'kind' must be a str, got {type(kind).__name__}")
    if not KIND_PATTERN.fullmatch(kind):
        raise ProtocolError(
            f"message kind {kind[:40]!r} is not a short identifier: a lowercase letter, then at most 31 "
            "lowercase letters, digits or underscores"
        )


def check_header(kind: str, header: Any) -> None:
    """Raise ProtocolError unless ``header`` is plain data and, for a session kind, follows its schema."""
    _check_plain(kind, header)
    if kind in SESSION_KINDS:
        check_fields(kind, header, *SESSION_HEADERS[kind])

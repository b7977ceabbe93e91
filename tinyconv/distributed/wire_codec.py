"""Reduced precision on the wire as a codec at the edges: narrowed as a message is encoded, widened as it is decoded.

The ``narrow`` and ``reply`` headers, and their checks before anything is widened: docs/how-it-works.md, "Narrower
words on the wire". The master's edge is an op's codec in ``rpc.py`` (:class:`Narrowing`); the worker's is
``worker/handler.py``'s :func:`decode_task`, :func:`read_back` and :func:`encode_result`. A backend that converts
words on its device (``backends.base.WireConversion``) widens and narrows there what it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from backends.base import Backend, WireConversion
from tinyconv.distributed import wire_precision
from tinyconv.distributed.protocol import TASKS, TaskError
from tinyconv.distributed.wire_precision import Declared, Narrowed
from transports.base import Message
from transports.wire import ProtocolError, check_fields

# the tasks whose arrays may travel narrowed: a layer's, which say ``layer`` (not calibrations, not the replicas')
NARROWABLE = frozenset(kind for kind, schema in TASKS.items() if "layer" in schema.header)
_KEYS = ("narrow", "reply")


class Narrowing:
    """The codec of an op whose arrays travel in ``formats`` (array name -> format, both ways); each way
    also says how many arrays could not go as asked (float32 where a narrower word would overflow)."""

    def __init__(self, formats: dict[str, str]) -> None:
        self.formats = formats

    def encode(self, msg: Message) -> tuple[Message, int]:
        """A float32 task as it goes: its arrays narrowed, its result asked for in the same formats;
        and how many of its arrays fell back to float32."""
        arrays, narrow, fell_back = narrowed(msg.arrays, self.formats)
        reply = {name: f for name, f in self.formats.items() if name in TASKS[msg.kind].result.split() and f != "fp32"}
        header = msg.header | ({"narrow": narrow} if narrow else {}) | ({"reply": reply} if reply else {})
        return Message(msg.kind, header, arrays), fell_back

    def decode(self, reply: Message, task: Message) -> tuple[Message, int]:
        """A result of ``task`` (as it went) in float32, its ``narrow`` checked and gone; and how many
        of the arrays the task asked for narrow came back float32 (fell back). A RuntimeError if malformed."""
        try:
            check_fields("result", {k: reply.header[k] for k in ("narrow",) if k in reply.header}, {}, {"narrow": dict})
        except ProtocolError as e:
            raise RuntimeError(f"a malformed result of {task.kind}: {e}") from None
        narrow = _declarations(f"a result of {task.kind}", reply, RuntimeError)
        asked = task.header.get("reply", {})
        fell_back = sum(1 for name in reply.arrays if name in asked and name not in narrow)
        header = {k: v for k, v in reply.header.items() if k != "narrow"}
        return Message(reply.kind, header, widened(reply.arrays, narrow)), fell_back


def decode_task(msg: Message, backend: Backend, on_backend: frozenset[str]) -> tuple[Message, dict[str, str]]:
    """A task as it came -> (the task in float32 without ``narrow`` and ``reply``, the formats its
    result is asked for in). Its arrays named in ``on_backend`` are widened on the backend where it
    converts their format there. A task with neither key, or of a kind that may not carry them
    (``protocol.check_task`` refuses them there), is returned as it is."""
    if msg.kind not in NARROWABLE or not isinstance(msg.header, dict) or not any(k in msg.header for k in _KEYS):
        return msg, {}
    try:
        check_fields(msg.kind, {k: msg.header[k] for k in _KEYS if k in msg.header}, {}, dict.fromkeys(_KEYS, dict))
    except ProtocolError as e:
        raise TaskError(str(e)) from None
    narrow = _declarations(msg.kind, msg, TaskError, frozenset(TASKS[msg.kind].labels.split()))
    reply = msg.header.get("reply", {})
    results = set(TASKS[msg.kind].result.split())
    _check_formats(f"{msg.kind}'s reply", reply, results, TaskError, lambda _, fmt: wire_precision.check_format(fmt))

    def widen(name: str, carried: np.ndarray, declared: Declared) -> Any:
        # on a backend that converts the format there (s8's declaration is a list: on the host)
        if name in on_backend and isinstance(declared, str) and isinstance(backend, WireConversion):
            there = backend.widen_wire(carried, declared)
            if there is not None:
                return there
        return wire_precision.widen(carried, declared)

    header = {k: v for k, v in msg.header.items() if k not in _KEYS}
    return Message(msg.kind, header, widened(msg.arrays, narrow, widen)), reply


def read_back(backend: Backend, a: Any, fmt: str) -> np.ndarray | Narrowed:
    """A result array on the host: narrowed on the device if the backend does ``fmt`` there and
    nothing became infinite (then :func:`encode_result` falls back to float32 from all of it)."""
    if fmt != "fp32" and not isinstance(a, np.ndarray) and isinstance(backend, WireConversion):
        got = backend.narrow_wire(a, fmt)
        if got is not None and not got[1]:
            return Narrowed(got[0], fmt, False, wire_precision.declare(fmt, tuple(a.shape)))
    return np.ascontiguousarray(backend.to_numpy(a))


def encode_result(arrays: dict[str, np.ndarray | Narrowed], asked: dict[str, str]) -> tuple[dict, dict]:
    """A result's arrays as they go, in the formats ``asked`` (an overflow goes back float32), and
    the header keys that say so."""
    out, narrow, _ = narrowed(arrays, asked)
    return out, ({"narrow": narrow} if narrow else {})


def narrowed(
    arrays: dict[str, np.ndarray | Narrowed], formats: dict[str, str]
) -> tuple[dict[str, np.ndarray], dict[str, Declared], int]:
    """float32 ``arrays`` as they go on the wire, each in ``formats``' format for it (float32 if none):
    (the arrays, the header's ``narrow`` for them -- each one's declaration, ``Narrowed.declared`` --,
    how many fell back to float32). An array already narrowed (a ``Narrowed``: a worker's device did
    it, :func:`read_back`) goes as it is."""
    out: dict[str, np.ndarray] = {}
    narrow: dict[str, Declared] = {}
    fallbacks = 0
    for name, a in arrays.items():
        fmt = formats.get(name, "fp32")
        if fmt == "fp32" and not isinstance(a, Narrowed):
            out[name] = a
            continue
        n = a if isinstance(a, Narrowed) else wire_precision.narrow(a, fmt)
        out[name], fallbacks = n.carried, fallbacks + n.fell_back
        if n.fmt != "fp32":
            narrow[name] = n.declared
    return out, narrow, fallbacks


def widened(
    arrays: dict[str, np.ndarray],
    narrow: dict[str, Declared],
    widen: Callable[[str, np.ndarray, Declared], Any] = lambda _, a, declared: wire_precision.widen(a, declared),
) -> dict[str, Any]:
    """Checked ``arrays`` (:func:`_declarations`), each float32 again: those ``narrow`` names widened by
    ``widen(name, carried, declared)`` (new arrays; by default on the host), the others as they are."""
    return {name: widen(name, a, narrow[name]) if name in narrow else a for name, a in arrays.items()}


def _declarations(
    what: str, msg: Message, error: type[Exception], labels: frozenset[str] = frozenset()
) -> dict[str, Declared]:
    """``msg``'s header ``narrow``, checked: it names some of its float32 arrays, each a well-formed carrier of
    what it declares (``wire_precision.check_carried``)."""
    narrow = msg.header.get("narrow", {})
    names = set(msg.arrays) - labels
    _check_formats(
        f"{what}'s narrow", narrow, names, error, lambda name, d: wire_precision.check_carried(d, msg.arrays[name])
    )
    return narrow


def _check_formats(
    what: str, formats: dict, names: set[str], error: type[Exception], check: Callable[[str, Any], object]
) -> None:
    """``formats`` must map some of ``names`` to what ``check(name, format)`` accepts (a ValueError: not)."""
    for name, fmt in formats.items():
        if name not in names:
            raise error(f"{what} names {name!r}, which is not one of its float32 arrays {sorted(names)}")
        try:
            check(name, fmt)
        except ValueError as e:
            raise error(f"{what}: {name}: {e}") from None

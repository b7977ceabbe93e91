"""The task protocol: what the master asks a worker to compute, and what comes back.

A transport moves messages without knowing what they mean (``transports/wire.py``
checks the envelope: kind, plain header, array dtypes and sizes); this file says what
they mean. One task kind per operation on the worker, each answered by a ``result``
carrying the seconds it computed (``compute_s``) and the arrays below, or by an
``error`` naming what was wrong. Every task header has ``task``, the id its reply
echoes; the layer's tasks also ``step`` and ``layer`` (its index), which tie the
parts of one layer's step together on the worker.

Split by kernels, the paper's way (``by_kernels.py``)::

    block_forward     stride, padding, tail, own     x (N, C, H, W), w (F', C, K, K), b (F',)
                      -> y (N, own, OH', OW'): the block of F' kernels (own and halo), the own ones' output
    block_backward    need_dx                        dy (N, F', OH', OW'), over every computed kernel
                      -> dx (N, C, H, W) if need_dx, a partial sum; dw (own, C, K, K), db (own,)

And once, before training (``calibrate.py``)::

    calibrate         layers, repeats                -> times: seconds per layer, no arrays

The other tasks -- split by input channels (``by_channels.py``): ``partial_forward``, ``tail_forward``,
``tail_backward``, ``partial_backward``; data parallelism: ``replica_calibrate``, ``replica_step``; the
hybrid: ``hybrid_calibrate``, ``hybrid_forward``, ``hybrid_backward`` -- are laid out beside their handlers
(``worker/channel_handlers.py``, ``worker/replica_handlers.py``); their schemas are entries below.

All arrays are float32 but the labels ``y`` (int32 or int64). Which task may follow which on one layer is the worker's
business (``tinyconv/distributed/worker/state.py``).

Narrower words on the wire (``--wire-precision``) are a codec at the edges, not part of this
protocol: ``wire_codec.py`` adds its header keys ``narrow`` and ``reply`` to a layer's task as it
is sent and takes them off, widening the arrays to float32, before the worker checks it here (and
the same for the result, on the master's side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transports.base import Message
from transports.wire import Int, Num, ProtocolError, check_fields

# of this task protocol, wire_codec.py's ``narrow`` and ``reply`` included: one more for any change to a task or
# result; a worker's hello says which it speaks, the transport admits equals
VERSION = 8


class TaskError(ValueError):
    """A task the worker cannot run as asked; the text goes back to the master."""


@dataclass(frozen=True)
class Schema:
    """The header keys (name -> type) and array names of one message kind."""

    header: dict[str, type]
    arrays: frozenset[str] = frozenset()
    optional_arrays: frozenset[str] = frozenset()
    labels: frozenset[str] = frozenset()  # the arrays of integer labels (int32 or int64); every other is float32


_LAYER = {"task": Int, "step": Int, "layer": Int}
_CONV = {"stride": Int, "padding": Int, "tail": list}

TASKS: dict[str, Schema] = {
    "calibrate": Schema({"task": Int, "layers": list, "repeats": Int}),
    "block_forward": Schema({**_LAYER, **_CONV, "own": list}, frozenset({"x", "w", "b"})),
    "block_backward": Schema({**_LAYER, "need_dx": bool}, frozenset({"dy"})),
    "partial_forward": Schema(
        {**_LAYER, **_CONV, "halo": list, "own": list, "give": list}, frozenset({"x"}), frozenset({"w"})
    ),
    "tail_forward": Schema(_LAYER, optional_arrays=frozenset({"b", "sum"})),
    "tail_backward": Schema(_LAYER, frozenset({"dy"})),
    "partial_backward": Schema({**_LAYER, "need_dx": bool}, optional_arrays=frozenset({"dyc_lo", "dyc_hi"})),
    "replica_calibrate": Schema({"task": Int, "net": dict, "batch": Int, "repeats": Int}),
    "replica_step": Schema(
        {"task": Int, "step": Int, "net": dict, "batch": Int},
        frozenset({"x", "y", "params"}),
        frozenset({"buffers"}),
        labels=frozenset({"y"}),
    ),
    "hybrid_calibrate": Schema({"task": Int, "net": dict, "batch": Int, "repeats": Int}),
    "hybrid_forward": Schema(
        {"task": Int, "step": Int, "net": dict, "batch": Int}, frozenset({"x", "params"}), frozenset({"buffers"})
    ),
    "hybrid_backward": Schema({"task": Int, "step": Int}, frozenset({"dfeatures"})),
}

# what each task's result may carry (the master checks their shapes as it reads them)
RESULT_ARRAYS: dict[str, frozenset[str]] = {
    "calibrate": frozenset(),
    "block_forward": frozenset({"y"}),
    "block_backward": frozenset({"dx", "dw", "db"}),
    "partial_forward": frozenset({"p_lo", "p_hi"}),
    "tail_forward": frozenset({"y"}),
    "tail_backward": frozenset({"dyc"}),
    "partial_backward": frozenset({"dx", "dw", "db"}),
    "replica_calibrate": frozenset(),
    "replica_step": frozenset({"grads", "logits", "buffers"}),
    "hybrid_calibrate": frozenset(),
    "hybrid_forward": frozenset({"features", "buffers"}),
    "hybrid_backward": frozenset({"grads"}),
}
TIMED = ("calibrate", "replica_calibrate", "hybrid_calibrate")  # the tasks whose result says ``times``
RESULT = {"task": Int, "compute_s": Num}
CALIBRATE_RESULT = {**RESULT, "times": list}
# the tasks that may carry a chunk of the batch, ``images`` = [a, b, N] (``by_channels.py``'s pipeline)
CHUNKED = frozenset({"partial_forward", "tail_forward", "partial_backward"})


def message_cap_bytes(convs: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]) -> int:
    """The most bytes one task or result of these convolutions may carry, each given as its shapes
    (x (N, C, H, W), its output (N, F, OH, OW), w (F, C, K, K)): no message above holds more than one
    layer's x, two of its conv outputs (p_lo and p_hi may overlap), its weights and biases together
    (the tails only shrink the maps, the halos only widen a slice to at most F); at least 1 MiB."""
    biggest = max((math.prod(x) + 2 * math.prod(y) + math.prod(w) + w[0] for x, y, w in convs), default=0)
    return max(1 << 20, 4 * biggest)


def check_task(msg: Message) -> Schema:
    """Raise TaskError unless ``msg`` is a known task with exactly its header keys, its arrays, float32.

    Returns the kind's schema. Values are checked for type only; their meaning (spans that fit,
    shapes that match) is each handler's to check.
    """
    schema = TASKS.get(msg.kind)
    if schema is None:
        raise TaskError(f"a worker does not handle {msg.kind!r} messages; send one of {', '.join(TASKS)}")
    optional = {"images": list} if msg.kind in CHUNKED else {}
    optional |= {"smoothing": Num} if msg.kind == "replica_step" else {}
    try:
        check_fields(msg.kind, msg.header, schema.header, optional)
    except ProtocolError as e:
        raise TaskError(str(e)) from None
    _check_arrays(msg.kind, msg, schema.arrays, schema.arrays | schema.optional_arrays, TaskError, schema.labels)
    return schema


def check_result(msg: Message, task_kind: str) -> None:
    """Raise RuntimeError unless ``msg`` is a well-formed result of a ``task_kind`` task."""
    fields = CALIBRATE_RESULT if task_kind in TIMED else RESULT
    try:
        check_fields("result", msg.header, fields, {})
    except ProtocolError as e:
        raise RuntimeError(f"a malformed result of {task_kind}: {e}") from None
    if not msg.header["compute_s"] >= 0:
        raise RuntimeError(f"a result of {task_kind} reports compute_s {msg.header['compute_s']!r}, not seconds >= 0")
    _check_arrays(f"a result of {task_kind}", msg, frozenset(), RESULT_ARRAYS[task_kind], RuntimeError)


def _check_arrays(
    what: str,
    msg: Message,
    required: frozenset[str],
    allowed: frozenset[str],
    error: type[Exception],
    labels: frozenset[str] = frozenset(),
) -> None:
    names = set(msg.arrays)
    if not required <= names <= allowed:
        optional = sorted(allowed - required)
        raise error(
            f"{what} takes the arrays {sorted(required)}{f' and optionally {optional}' if optional else ''}, "
            f"got {sorted(names) or 'none'}"
        )
    for name, a in msg.arrays.items():
        if name in labels:
            if a.dtype.name not in ("int32", "int64"):
                raise error(f"{what}: {name} holds labels and must be int32 or int64, got {a.dtype}")
        elif a.dtype.name != "float32":
            raise error(f"{what}: {name} must be float32, got {a.dtype}")
